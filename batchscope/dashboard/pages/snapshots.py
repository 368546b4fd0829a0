"""The Snapshots page, run by ``st.navigation`` in ``app.py`` (code: ``dashboard.snapshots``)."""

from batchscope.dashboard import scope, snapshots

if __name__ == "__main__":  # how st.navigation runs it; an import draws nothing
    snapshots.render(scope.current())
