"""The exercise checks: one module per lesson, ``lessonNN``, defining its questions ``q1, q2, ...``; what the checks of
lessons 00, 01, 02 and 04 share (``stand_in``); and the machinery of timed checks, each side in a process of its
own (``timed_check``, ``timed_worker``, ``observe``, ``portable``)."""
