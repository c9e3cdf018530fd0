"""Admission control: may a request enter now, and in which order does it leave the queue?"""

from tokenpath.admission.capacity import CapacityEstimator
from tokenpath.admission.controller import Admission, AdmissionConfig, FlowController
from tokenpath.admission.queue import FairQueue, Ticket

__all__ = ["Admission", "AdmissionConfig", "CapacityEstimator", "FairQueue", "FlowController", "Ticket"]
