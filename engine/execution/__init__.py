"""Running a planned step: the runner and what it starts."""
