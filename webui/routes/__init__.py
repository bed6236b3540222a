"""One router per resource of the console: auth, overview, models, knobs, switch, logs."""
