"""The Fleet page, run by ``st.navigation`` in ``app.py`` (code: ``dashboard.fleet``)."""

from batchscope.dashboard import fleet, scope

if __name__ == "__main__":  # how st.navigation runs it; an import draws nothing
    fleet.render(scope.current())
