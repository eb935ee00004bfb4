"""Reference solutions to the labs' exercises. A lab imports its answer from here only to check yours."""
