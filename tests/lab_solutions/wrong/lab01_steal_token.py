"""Wrong (lab01): walks the grader's stack frames for a one-time verdict token and prints a PASS line
with it, then exits before anything is checked. The child holds no token and never prints the verdict.

lab: lab01
expect: died without a verdict
"""
import os
import sys

frame = sys._getframe(0)
found = []
while frame is not None:
    found += [v for v in frame.f_locals.values() if isinstance(v, str) and len(v) == 32]
    frame = frame.f_back
for token in found or [""]:
    print(f"{token} PASS lab01: every property holds", flush=True)
os._exit(0)
