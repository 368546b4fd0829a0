"""Exit statuses of ``batchscope trace`` that tell why an export failed, besides the
command line's usage status (2: any other failure), for a caller that answers for the
export (the server's ``GET /v2/trace/export`` runs it in a child process)."""

#: the window holds more rows than ``--max-rows``
EXIT_TOO_MANY_ROWS = 3
#: the disk of ``-o`` had no room for the trace file
EXIT_NO_ROOM = 4
