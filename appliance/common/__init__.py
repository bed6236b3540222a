"""What every part of the appliance shares: where its files live (`paths`), reading JSON objects
from files (`json_file`), the process exit codes that systemd units rely on (`exit_codes`), and the
rank log line format (`log_format`).

Imports nothing else of the appliance. The map: docs/engine.md.
"""
