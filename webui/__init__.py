"""Web admin console (FastAPI).

Arrives with the console issue; the package exists now so the layout is stable."""
