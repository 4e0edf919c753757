"""The terminal the CLI writes to, which cannot be driven by the text it shows.

A user name, a path, a prompt or a line of data may carry control sequences (``ESC [ 2 J`` clears the
screen, ``ESC ] 0 ;`` retitles the window, ``ESC ] 8 ;`` plants a link, a bidirectional override
reorders what is read): shown as they are, they would forge output. :class:`SafeConsole` is a rich
``Console`` that shows every such character of the *text* it renders as its escape
(:func:`~ondevice_moe.names.printable`), at the last step, after tables and panels were laid out;
rich's own styling and cursor movements (progress bars) are added after that step and are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.segment import Segment

from ondevice_moe.names import printable


class SafeConsole(Console):
    """A rich ``Console`` whose rendered text never carries a control character of its own."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            segment if segment.control else Segment(printable(segment.text, keep_newlines=True), segment.style)
            for segment in buffer)
