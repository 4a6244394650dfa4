"""The Trio side of the real engine: one ``EnginePort`` over two transports (design/012).

``port.py`` holds the port (:class:`CorePort`, whose calls are ``engine/calls.py``'s frozen
dataclasses) and the :class:`Transport` seam; ``thread.py`` the engine thread
(``ThreadedEngine``), ``process.py`` the engine process (``ProcessEngine``). The engine core
that answers the calls, and the process's main loop, are synchronous and live in ``engine/``.
"""
