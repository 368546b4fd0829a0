"""What a user of the runtime writes against: the model hooks, the settings, the errors.

- ``model``: ``ModelAPI``, the hooks a served model implements, and ``check_model``,
  whose errors say which code to write.
- ``config``: ``BatchingConfig`` and ``ServerConfig``, typed and validated settings
  with units in their names.
- ``errors``: the error hierarchy (each error carries its HTTP status) and
  ``error_answer``, the one function that turns any exception into an HTTP answer.
"""
