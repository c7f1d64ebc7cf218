"""The one error the fitter raises: the worker must not start, and the message says why."""

from __future__ import annotations


class FitError(RuntimeError):
    """Nothing safe could be fitted (no device, a failed measurement, or too little memory).

    The message is meant for operators: it names what does not fit and shows the breakdown.
    """
