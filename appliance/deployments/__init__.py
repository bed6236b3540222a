"""The deployment file: its typed schema and knob sections (`deployment`, `knob_schema`), files,
templates and overrides merged into one effective deployment (`files`), diffs (`diff`), memory plans
(`plan`), the HTTP key files it names (`http_keys`), its log folder (`log`), and the support bundle
(`support_bundle`).

May import `models` and `common`. The map: docs/engine.md.
"""
