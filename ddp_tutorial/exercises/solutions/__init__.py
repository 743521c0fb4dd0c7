"""Reference solutions, one script per exercise: shown by ``exercises.solution(name)`` on request."""
