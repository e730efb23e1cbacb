"""Wrong (lab01): walks the grader's stack frames for a one-time verdict token and prints a PASS line
with it, then exits before anything is checked. The source check refuses it; without that check (a test
runs it so) the child holds no token, never prints the verdict, and the exit leaves no results.

lab: lab01
expect: uses sys
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
