"""BatchScope dashboard: ``streamlit run app.py``.

The entry script of a multipage app: it builds the sidebar into a ``Scope`` (database,
instance, model, time window, SLO), says where the data comes from, and runs the page
picked in the top bar: Live, Batch timeline, Tuning, Fleet or Snapshots. The pages live in
``batchscope/dashboard/`` (see its ``__init__`` for the map). With no runtime reporting
to the configured database the bundled demo runtime is started (once per server process;
``BATCHSCOPE_NO_DEMO=1`` or the sidebar toggle turns that off). The sidebar ends with the
version of BatchScope that draws the page.
"""

from __future__ import annotations

import streamlit as st

from batchscope.dashboard import demo, scope
from batchscope.version import version

PAGES = "batchscope/dashboard/pages"
# headline numbers sit six to a row: a smaller value font keeps "50.3 ms" or
# "1.67 GiB" whole instead of cut to "50.3 …" on a laptop-sized window
METRIC_CSS = ("<style>[data-testid='stMetricValue']{font-size:1.6rem}"
              "[data-testid='stMetricLabel'] p{font-size:0.8rem}</style>")


def footer() -> str:
    """The sidebar's last line: which BatchScope draws the page."""
    return f"BatchScope {version()}"


def main() -> None:
    st.set_page_config(page_title="BatchScope", page_icon="📦", layout="wide")
    st.markdown(METRIC_CSS, unsafe_allow_html=True)
    pages = st.navigation([
        st.Page(f"{PAGES}/live.py", title="Live", icon=":material/monitoring:",
                url_path="live", default=True),
        st.Page(f"{PAGES}/timeline.py", title="Batch timeline", icon=":material/view_timeline:",
                url_path="timeline"),
        st.Page(f"{PAGES}/tuning.py", title="Tuning", icon=":material/tune:", url_path="tuning"),
        st.Page(f"{PAGES}/fleet.py", title="Fleet", icon=":material/lan:", url_path="fleet"),
        st.Page(f"{PAGES}/snapshots.py", title="Snapshots", icon=":material/inventory_2:",
                url_path="snapshots"),
    ], position="top")
    with scope.reads_guarded():  # a locked or silent database: said, not a stack trace
        current = scope.from_sidebar()
        demo_allowed = demo.allowed_from_sidebar()
        st.sidebar.caption(footer())
        scope.remember(current)
        st.title("BatchScope")
        demo.show_source(current, demo_allowed=demo_allowed)
        if current.refresh_s is not None:
            scope.fragment(scope.rerun_when_runtimes_change, scope.WATCH_EVERY_S)(current)
        pages.run()


main()
