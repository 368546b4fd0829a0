"""The Tuning page, run by ``st.navigation`` in ``app.py`` (code: ``dashboard.tuning``)."""

from batchscope.dashboard import scope, tuning

if __name__ == "__main__":  # how st.navigation runs it; an import draws nothing
    tuning.render(scope.current())
