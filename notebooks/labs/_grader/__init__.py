"""The graders of the labs: one module per lab (``labNN.py``, its ``check(solution)``) and ``common``.

Run through ``notebooks/labs/grade.py``, which starts them in a child process with a time limit.
"""
