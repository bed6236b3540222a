"""The deployment file as the console manages it: reads and atomic replacement with earlier versions
kept (`store`), new deployments from the current one (`edit`), and the knobs form generated from the
schema (`knob_form`).

Imports only the appliance and the engine. The map: docs/engine.md.
"""
