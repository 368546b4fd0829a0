"""The Batch timeline page, run by ``st.navigation`` in ``app.py`` (code: ``dashboard.timeline``)."""

from batchscope.dashboard import scope, timeline

if __name__ == "__main__":  # how st.navigation runs it; an import draws nothing
    timeline.render(scope.current())
