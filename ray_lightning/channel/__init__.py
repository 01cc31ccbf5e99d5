"""Calls from rank 0 to the driver while a call runs, and rank 0's progress bar drawn by the driver.

``send_to_driver(function, *args)`` (from a callback on rank 0) runs ``function(*args)`` in the
process that called ``fit``; :mod:`.driver_channel` is both ends, :mod:`.progress` the bar.
"""

from ray_lightning.channel.driver_channel import send_to_driver

__all__ = ["send_to_driver"]
