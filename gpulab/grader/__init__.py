"""The instructor's grading: notebooks run contained in fresh kernels (``execute``, ``grade_worker``), the
grades (``grading``), and the check that the installed checks graded them (``integrity``)."""
