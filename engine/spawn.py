"""Child processes started with ``spawn`` that do not import the parent's ``__main__``.

``multiprocessing``'s spawn has each child import the parent's main module before it runs its
target (as ``__mp_main__``), so that targets defined there can be found. Ours never are: the engine
process and the kernel primers run functions of this package. Under ``mlx-trio serve`` that import
is the whole CLI (trio, pydantic, httpx, Hypercorn, Starlette: 1.0 s on the 2-core dev machine, in
every child, and on the GPU hosts' slower imports more), paid on the engine process's path to
healthy. :func:`start` leaves it out.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.process import BaseProcess

_MAIN_HIDDEN = threading.Lock()  # one start at a time sees ``__main__`` without its origin


def start(process: BaseProcess) -> None:
    """``process.start()``, its child importing none of this process's ``__main__``: spawn
    names the main module to import by its ``__spec__`` or ``__file__``
    (``multiprocessing.spawn.get_preparation_data``), so both are hidden while it starts."""
    main = sys.modules["__main__"]
    with _MAIN_HIDDEN:
        saved = {key: vars(main)[key] for key in ("__spec__", "__file__") if key in vars(main)}
        main.__spec__ = None
        vars(main).pop("__file__", None)
        try:
            process.start()
        finally:
            vars(main).pop("__spec__", None)
            vars(main).update(saved)
