"""Admission: the bounded priority queue in front of the engine (pure Python, no torch)."""

from inferd.admission.queue import AdmissionQueue, QueueEntry

__all__ = ["AdmissionQueue", "QueueEntry"]
