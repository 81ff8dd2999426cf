"""One module per lesson, ``lessonNN``, defining that lesson's exercise questions ``q1, q2, ...``."""
