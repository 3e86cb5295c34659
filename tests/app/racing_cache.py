"""A job cache that loses a race on purpose, for the tests of the job managers' polls (tests/app/test_jobs.py
on the disk cache, tests/app/test_workers.py on Redis)."""

from __future__ import annotations


class WritesAfterFirstRead:
    """A job cache (or Redis client) through which a job writes its next progress report right after a
    poll's first read of the progress key, as a job can between two requests of a poll."""

    def __init__(self, real, write):
        self._real, self._write, self.written = real, write, False

    def _after(self, value):
        if not self.written:
            self.written = True
            self._write()
        return value

    def get(self, *args, **kwargs):
        return self._after(self._real.get(*args, **kwargs))

    def pop(self, *args, **kwargs):
        return self._after(self._real.pop(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._real, name)
