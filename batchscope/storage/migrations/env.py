"""Alembic's entry point for BatchScope's migrations.

``batchscope.storage.db.init_schema`` runs them on a connection it holds under a lock,
handed over as ``config.attributes["connection"]``, inside that connection's
transaction: the upgrade is committed (or rolled back) as a whole by the caller.

Run by the ``alembic`` command line instead (writing a new revision: ``alembic
revision --autogenerate`` with a config whose ``script_location`` is this folder), the
connection is opened here from ``-x url=...`` or the config's ``sqlalchemy.url``,
without the lock. Imported as a plain module (as tools that import every module do),
this file only defines its functions.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from batchscope.storage.migrations import VERSION_TABLE
from batchscope.storage.schema import Base


def run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      version_table=VERSION_TABLE, compare_type=True,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    if context.is_offline_mode():
        raise SystemExit("BatchScope's migrations run online only (they look at the database "
                         "they upgrade); leave out --sql")
    given = context.config.attributes.get("connection")
    if given is not None:
        run(given)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") \
        or context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("name the database: alembic -x url=sqlite:///path/to/batchscope.db ...")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        run(connection)
        connection.commit()


if __name__ != "batchscope.storage.migrations.env":  # loaded by Alembic
    main()
