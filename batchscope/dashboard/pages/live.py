"""The Live page, run by ``st.navigation`` in ``app.py`` (code: ``dashboard.live``)."""

from batchscope.dashboard import live, scope

if __name__ == "__main__":  # how st.navigation runs it; an import draws nothing
    live.render(scope.current())
