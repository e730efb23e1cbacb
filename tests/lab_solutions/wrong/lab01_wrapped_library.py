"""Wrong (lab01): the library's merge behind a wrapper and a functools.partial, under other names.

lab: lab01
expect: calls ringattn_ref.softmax.
"""
import functools

from ringattn_ref import softmax as _s

_fold = functools.partial(_s.online_update, keep=None)


def online_update(m, l, o, s, v):
    return _fold(m, l, o, s, v)


class _Combine:
    def __call__(self, *parts):
        return _s.merge(*parts)


merge = _Combine()
