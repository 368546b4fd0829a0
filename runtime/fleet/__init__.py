"""Several replicas of the runtime as one service.

``ray_serve``: a Ray Serve application whose replicas each run the whole BatchScope
engine behind Ray Serve's router (``batchscope serve --replicas N``, or ``serve run
runtime.fleet.ray_serve:app_builder``). Needs the ``fleet`` extra (``ray[serve]``).
"""
