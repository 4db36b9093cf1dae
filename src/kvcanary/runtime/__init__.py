"""The canary runtime: buffers, plans, HEAD/TAIL/SWEEP, reporting, policies, watchdog."""
