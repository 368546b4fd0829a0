"""Reading recorded data: ``queries`` (aggregated in SQL, one DataFrame each) and
``diagnosis`` (rules with evidence and guidance)."""
