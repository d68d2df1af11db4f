"""Emulated IPUs: devices, the step program and the executor."""
