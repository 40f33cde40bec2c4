"""A min-heap of ``(key, order)`` pairs in two arrays, compiled with numba.

The packing's bins (``planner/packing_fit.py``: tokens, bin) pop the least
pair first; the orders are unique, so the pop sequence does not depend on the
heap's layout.  (The replay's pending ends, ``sim/event_loop.py``, are a sorted
list instead: there a new end lies behind a third of them.)  Comparisons only: no
arithmetic on the keys.  And min-heaps
of single keys laid in slices of one array (:func:`key_push`, :func:`key_pop`):
the replay's compute lanes and the surrogate's (``planner/surrogate_ulysses.py``)
pick a rank's first ready op in lane order with them.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def push(heap_t, heap_c, n, t, c):
    """Push (``t``, ``c``) onto the heap of ``n`` entries; returns its new size."""
    i = n
    while i > 0:
        parent = (i - 1) >> 1
        pt, pc = heap_t[parent], heap_c[parent]
        if t < pt or (t == pt and c < pc):
            heap_t[i], heap_c[i] = pt, pc
            i = parent
        else:
            break
    heap_t[i], heap_c[i] = t, c
    return n + 1


@njit(cache=True)
def pop(heap_t, heap_c, n):
    """The least (``t``, ``c``) and the heap's new size."""
    t0, c0 = heap_t[0], heap_c[0]
    n -= 1
    if n > 0:
        t, c = heap_t[n], heap_c[n]
        i = 0
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            other = child + 1
            if other < n and (heap_t[other] < heap_t[child]
                              or (heap_t[other] == heap_t[child] and heap_c[other] < heap_c[child])):
                child = other
            if heap_t[child] < t or (heap_t[child] == t and heap_c[child] < c):
                heap_t[i], heap_c[i] = heap_t[child], heap_c[child]
                i = child
            else:
                break
        heap_t[i], heap_c[i] = t, c
    return t0, c0, n


@njit(cache=True, _nrt=False)
def key_push(heap, base, n, key):
    """Push ``key`` onto the min-heap ``heap[base : base + n]``; returns its new size."""
    i = n
    while i > 0:
        parent = (i - 1) >> 1
        if key < heap[base + parent]:
            heap[base + i] = heap[base + parent]
            i = parent
        else:
            break
    heap[base + i] = key
    return n + 1


@njit(cache=True, _nrt=False)
def key_pop(heap, base, n):
    """The smallest key of ``heap[base : base + n]`` (then ``n - 1`` keys remain)."""
    top = heap[base]
    n -= 1
    if n > 0:
        key = heap[base + n]
        i = 0
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and heap[base + child + 1] < heap[base + child]:
                child += 1
            if heap[base + child] < key:
                heap[base + i] = heap[base + child]
                i = child
            else:
                break
        heap[base + i] = key
    return top
