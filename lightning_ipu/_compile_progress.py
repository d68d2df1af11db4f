"""A compilation's progress where Lightning drives: its phases printed through the Trainer's
progress bar (which keeps its own bars intact), not redrawn on standard error underneath it."""


class ProgressBarLines:
    """The display ``ipu_backend`` reports a compilation to (``lightning_seam.compilations_shown_by``):
    a line through ``progress_bar.print`` when each phase first starts, and the summary (or the
    failure) at the end."""

    def __init__(self, progress_bar):
        self._progress_bar = progress_bar
        self._shown: set[str] = set()

    def update(self, status) -> None:
        if status.phase is not None and status.phase not in self._shown:
            self._shown.add(status.phase)
            self._progress_bar.print(status.line())

    def close(self, status, failed: bool) -> None:
        self._progress_bar.print(status.failure() if failed else status.summary())


def display(trainer) -> ProgressBarLines | None:
    """What shows a compilation during ``trainer``'s run: its progress bar, or nothing when it has
    none (``Trainer(enable_progress_bar=False)``)."""
    progress_bar = None if trainer is None else trainer.progress_bar_callback
    return None if progress_bar is None else ProgressBarLines(progress_bar)
