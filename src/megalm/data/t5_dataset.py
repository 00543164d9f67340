"""Temporary alias for megalm.models.t5, which imports T5Samples by this old path: T5's samples live
in megalm.data.samples.t5. Delete this module when that import names the new path."""

from megalm.data.samples.t5 import T5Samples

__all__ = ["T5Samples"]
