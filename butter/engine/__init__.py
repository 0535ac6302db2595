"""The engine: admission, sessions, the step planner and the step loop (trio)."""
