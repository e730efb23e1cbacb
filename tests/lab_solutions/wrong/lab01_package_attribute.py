"""Wrong (lab01): the library's own answer, reached through the package attribute (not a top-level name).

lab: lab01
expect: calls ringattn_ref.softmax.
"""
import ringattn_ref


def online_update(m, l, o, s, v):
    return ringattn_ref.softmax.online_update(m, l, o, s, v)


def merge(o1, lse1, o2, lse2):
    return ringattn_ref.merge(o1, lse1, o2, lse2)
