"""Trace-driven, discrete-event cluster simulator in virtual time."""
