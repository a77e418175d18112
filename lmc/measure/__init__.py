"""Measuring: `lmc calibrate` (this machine as a hardware profile), `lmc bench` (a served artifact
under load) and the comparison of a plan's predictions with a bench report."""
