"""The closed loop (``--kareus-plan auto``): profile, calibrate, plan, switch; the simulated truth."""
