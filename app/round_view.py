"""The output view: each round drawn in place, token by token, from the RoundEvent stream.

Text goes in through QTextCursor (never HTML), so token text is shown exactly as generated: monospace, spaces
kept, newlines marked with a visible ↵ and then broken. Each token carries its kind and round as custom
character-format properties and an anchor href "t<index>" into `tokens`, which is how hover and click find it.
"""
from __future__ import annotations

import html
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Optional

from PySide6.QtCore import QEvent, QPoint, Signal
from PySide6.QtGui import (
    QColor,
    QFont,
    QFontDatabase,
    QPainter,
    QPen,
    QTextCharFormat,
    QTextCursor,
    QTextFormat,
)
from PySide6.QtWidgets import QTextEdit, QToolTip

from app.style import LIGHT, TokenColors

KIND_PROP = QTextFormat.UserProperty + 1
ROUND_PROP = QTextFormat.UserProperty + 2

PROMPT, ACCEPTED, REJECTED, UNTESTED, CORRECTION, BONUS, TARGET, NOTICE, BRANCHES = (
    "prompt", "accepted", "rejected", "untested", "correction", "bonus", "target", "notice", "branches")
EMITTED_KINDS = (ACCEPTED, CORRECTION, BONUS, TARGET)

KIND_LABELS = {
    ACCEPTED: "accepted draft token",
    REJECTED: "rejected draft token",
    UNTESTED: "draft token never tested (an earlier one was rejected)",
    CORRECTION: "target's correction (resampled after the rejection)",
    BONUS: "bonus token (every draft accepted; sampled from the target)",
    TARGET: "target token (plain decoding, nothing drafted)",
    BRANCHES: "rejected branches of this round's draft tree (click: the Draft tree panel)",
}


@dataclass
class TokenInfo:
    """What the view knows about one rendered token (a drafted token or the round's next token)."""

    kind: str
    round: int
    text: str
    depth: Optional[int] = None  # position in the round's draft (None for the next token)
    output_pos: Optional[int] = None  # index in the generated text (None when not emitted)
    p: Optional[float] = None
    q: Optional[float] = None
    accept_prob: Optional[float] = None
    u: Optional[float] = None
    accepted: Optional[bool] = None
    tested: Optional[bool] = None
    top: list = field(default_factory=list)
    branches: list = field(default_factory=list)  # BRANCHES: the rejected drafts' TokenInfos
    unknown: tuple = ()  # figures the round's source did not give (a server: "p", "q", "u", "top", ...)


def is_tree(event) -> bool:
    """A round whose draft branches (two drafted tokens at one depth): Medusa, lookahead, EAGLE's trees."""
    depths = [d.depth for d in event.drafted]
    return len(depths) != len(set(depths))


def round_tokens(event, clean: bool = False) -> list:
    """The tokens of one round in display order: the accepted path, what was rejected, then the next token.
    A chain's rejected drafts stand where they were proposed; a tree's rejected branches fold into one
    BRANCHES marker (hover lists them). `clean`: the emitted tokens only."""
    emitted = len(event.emitted_ids)
    accepted = sorted((d for d in event.drafted if d.accepted), key=lambda d: d.depth)
    rest = [d for d in event.drafted if not d.accepted]
    infos = [drafted_info(event, d, ACCEPTED, event.position + i)
             for i, d in enumerate(accepted) if i < emitted]
    rejected = [drafted_info(event, d, REJECTED if d.tested else UNTESTED, None) for d in rest]
    if not clean and rejected and is_tree(event):
        infos.append(TokenInfo(BRANCHES, event.round, f"⋔{len(rejected)}", branches=rejected))
    elif not clean:
        infos += rejected
    if emitted > len(accepted):
        infos.append(next_info(event, event.position + len(accepted)))
    return infos


def clean_text(infos) -> str:
    """What the model produced, from rendered tokens: emitted tokens' text as generated."""
    return "".join(info.text for info in infos if info.kind in EMITTED_KINDS)


def drafted_info(event, d, kind: str, output_pos: Optional[int]) -> TokenInfo:
    return TokenInfo(kind=kind, round=event.round, text=d.text, depth=d.depth, output_pos=output_pos, p=d.p,
                     q=d.q, accept_prob=d.accept_prob, u=d.u, accepted=d.accepted, tested=d.tested,
                     top=list(d.top), unknown=tuple(getattr(event, "unknown", ()) or ()))


def next_info(event, output_pos: int) -> TokenInfo:
    kind = TARGET if not event.drafted else (BONUS if event.next_is_bonus else CORRECTION)
    return TokenInfo(kind=kind, round=event.round, text=event.next_token_text, output_pos=output_pos,
                     p=event.next_token_p, top=list(event.next_top),
                     unknown=tuple(getattr(event, "unknown", ()) or ()))


def visible_whitespace(text: str) -> str:
    """Whitespace made visible, for text that is shown but is not part of the output (and for tooltips)."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"


def display_text(info: TokenInfo, clean: bool = False) -> str:
    """What the view inserts for a token: emitted text breaks lines after a ↵ mark; drafts that never made
    it into the output stay on the line, with their whitespace made visible. `clean`: the text as is."""
    if clean:
        return info.text
    if not info.text:
        return "∅"
    if info.kind in EMITTED_KINDS or info.kind == PROMPT:
        return info.text.replace("\r", "␍").replace("\n", "↵\n")
    return info.text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


NOT_GIVEN = "not given by the server"
# which distribution each figure of the inspector is (issue 52): a drafted token's p(x) is the target's
# sampling distribution (temperature, top-k and top-p applied, renormalised: what min(1, p/q) used); the
# next token's p(x) and the top alternatives are the softmax at the sampling temperature before top-k / top-p
# (greedy: T = 1 for all three)
DRAFT_P = "under the target's sampling distribution (T, top-k, top-p applied)"
SOFTMAX_P = "softmax of the target's logits at the sampling T (greedy: T = 1), before top-k / top-p"
TOP_LABEL = "target's top alternatives here (softmax at the sampling T, greedy T = 1, before top-k / top-p)"


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def where(info: TokenInfo) -> str:
    """'round 3, draft position 2, output token 17': every count from 1, as everywhere in the window."""
    return (f"round {info.round + 1}"
            + (f", draft position {info.depth + 1}" if info.depth is not None else "")
            + (f", output token {info.output_pos + 1}" if info.output_pos is not None else ""))


def describe(info: TokenInfo) -> str:
    """Rich-text description of a token (tooltip and inspector); every token string is escaped."""
    token = html.escape(visible_whitespace(info.text))
    lines = [f"<b><code>{token}</code></b> &nbsp; {html.escape(KIND_LABELS.get(info.kind, info.kind))}",
             where(info)]
    if info.kind == BRANCHES:
        rows = "".join(f"<tr><td><code>{html.escape(visible_whitespace(b.text))}</code></td>"
                       f"<td>position {b.depth + 1}</td><td>{html.escape(_verdict(b))}</td></tr>"
                       for b in info.branches)
        return "<br>".join(lines) + f"<table cellspacing='0' cellpadding='2'>{rows}</table>"
    if info.depth is not None:
        lines += _draft_numbers(info)
    elif "p" in info.unknown:
        lines.append(f"p(x): {NOT_GIVEN}")
    else:
        lines.append(f"p(x) = {_fmt(info.p, 4)}, the {SOFTMAX_P} (as the list below)")
    if info.top:
        rows = "".join(f"<tr><td><code>{html.escape(visible_whitespace(t))}</code></td>"
                       f"<td align='right'>{p:.3f}</td></tr>" for t, p in info.top)
        lines.append(f"{TOP_LABEL}:<table cellspacing='0' cellpadding='1'>{rows}</table>")
    elif "top" in info.unknown:
        lines.append(f"target's top alternatives: {NOT_GIVEN}")
    return "<br>".join(lines)


def is_greedy_test(info: TokenInfo) -> bool:
    """Tested without a uniform: the greedy rule (accept while the draft is the target's argmax)."""
    return bool(info.tested) and info.u is None


def _draft_numbers(info: TokenInfo) -> list:
    if "p" in info.unknown:  # a served round: the server counts its drafts but shows none of their figures
        outcome = "accepted" if info.accepted else ("rejected" if info.tested else "not tested")
        return [f"p(x), q(x), min(1, p/q), u: {NOT_GIVEN}",
                f"{outcome} (from the server's counters of this round)"]
    if is_greedy_test(info):
        return [f"p(x) = {_fmt(info.p, 4)} (the target's T = 1 probability, as in the list below, for "
                "reference)",
                _verdict(info),
                "Greedy (T = 0) compares the draft with the target's most likely token; the drafter's "
                "probability and the acceptance ratio play no part."]
    if not info.tested:  # never compared with the target: its p, q and ratio mean nothing
        return [_verdict(info)]
    return [f"p(x) = {_fmt(info.p, 4)} {DRAFT_P} &nbsp; q(x) = {_fmt(info.q, 4)} &nbsp; "
            f"min(1, p/q) = {_fmt(info.accept_prob, 4)}", _verdict(info),
            "(with top-k or top-p on, p(x) is renormalised over the tokens they keep, so it differs from the "
            "alternatives' list below, which is before them)"]


def _verdict(info: TokenInfo) -> str:
    if not info.tested:
        return "not tested: an earlier draft token was rejected"
    outcome = "accepted" if info.accepted else "rejected"
    if info.u is None:
        return f"greedy: {outcome} ({'is' if info.accepted else 'is not'} the target's argmax)"
    relation = "&lt;" if info.accepted else "≥"
    return f"u = {info.u:.4f} {relation} min(1, p/q) → {outcome}"


def chip(label: str, style: str) -> str:
    """A legend entry: `label` drawn as the tokens it names are."""
    return f"<span style='{style}; font-family: monospace'>&nbsp;{label}&nbsp;</span>"


def token_chips(colors: TokenColors) -> list:
    """The drafted and target token kinds as chips: the text's legend and the draft tree's share them."""
    return [
        chip("accepted", f"background:{colors.accepted_bg}"),
        chip("rejected", f"color:{colors.rejected_fg}; text-decoration: line-through"),
        chip("not tested", f"color:{colors.untested_fg}; text-decoration: line-through"),
        chip("correction", f"background:{colors.correction_bg}"),
        chip("bonus", f"background:{colors.bonus_bg}"),
    ]


def legend_html(colors: TokenColors) -> str:
    boundary = chip("target", "") + f"<span style='color:{colors.boundary}'>│</span> round boundary"
    return " &nbsp; ".join(token_chips(colors) + [boundary])


class RoundView(QTextEdit):
    """Read-only view of one generation: its prompt and every round, appended as events arrive."""

    tokenClicked = Signal(object)  # TokenInfo

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setReadOnly(True)
        self.setMouseTracking(True)
        self.setUndoRedoEnabled(False)
        font = QFontDatabase.systemFont(QFontDatabase.FixedFont)
        font.setStyleHint(QFont.Monospace)
        self.setFont(font)
        self.document().setDefaultFont(font)
        self.setTabStopDistance(4 * self.fontMetrics().horizontalAdvance(" "))
        self.tokens: list = []
        self._token_ranges: list = []  # (start, end) document positions of each token in `tokens`
        self._prompt_range = (0, 0)
        self._boundaries: list = []  # document positions where rounds 1, 2, ... begin
        self._formats: dict = {}
        self.clean = False  # True: the clean text (what the model produced), no drafts, no marks
        self.set_colors(LIGHT)

    # ---------------------------------------------------------------------------------------------- formats
    def set_colors(self, colors: TokenColors) -> None:
        """New colours apply to what is rendered next (the window re-renders the shown generation)."""
        self.colors = colors
        self._formats = {kind: self._make_format(kind) for kind in
                         (PROMPT, ACCEPTED, REJECTED, UNTESTED, CORRECTION, BONUS, TARGET, NOTICE, BRANCHES)}

    def set_clean(self, clean: bool) -> None:
        """Round view (False) or clean text (True); applies to what is rendered next."""
        self.clean = bool(clean)

    def _make_format(self, kind: str) -> QTextCharFormat:
        c = self.colors
        fmt = QTextCharFormat()
        fmt.setProperty(KIND_PROP, kind)
        fmt.setForeground(QColor(c.text))
        if kind in (PROMPT, NOTICE):
            fmt.setForeground(QColor(c.prompt))
        if kind == NOTICE:
            fmt.setFontItalic(True)
        backgrounds = {ACCEPTED: c.accepted_bg, CORRECTION: c.correction_bg, BONUS: c.bonus_bg}
        if kind in backgrounds:
            fmt.setBackground(QColor(backgrounds[kind]))
        if kind in (REJECTED, UNTESTED):
            fmt.setForeground(QColor(c.rejected_fg if kind == REJECTED else c.untested_fg))
            fmt.setFontStrikeOut(True)
        if kind == BRANCHES:
            fmt.setForeground(QColor(c.rejected_fg))
            fmt.setFontUnderline(True)
            fmt.setVerticalAlignment(QTextCharFormat.AlignSuperScript)
        return fmt

    def _token_format(self, kind: str) -> QTextCharFormat:
        if self.clean and kind in EMITTED_KINDS:
            fmt = QTextCharFormat()
            fmt.setProperty(KIND_PROP, kind)
            fmt.setForeground(QColor(self.colors.text))
            return fmt
        return QTextCharFormat(self._formats[kind])

    # ---------------------------------------------------------------------------------------------- content
    def clear_view(self) -> None:
        self.clear()
        self.tokens = []
        self._token_ranges = []
        self._prompt_range = (0, 0)
        self._boundaries = []

    def show_message(self, text: str) -> None:
        """Replace the content with a notice (e.g. how to open a model folder)."""
        self.clear_view()
        self._insert(text, self._formats[NOTICE])

    def show_generation(self, prompt: str, events, finish: Optional[str] = None) -> None:
        self.clear_view()
        self.append_prompt(prompt)
        for event in events:
            self.append_event(event, scroll=False)
        if finish:
            self.append_finish(finish)

    def append_prompt(self, prompt: str) -> None:
        self._prompt_range = self._insert(display_text(TokenInfo(PROMPT, -1, prompt), self.clean),
                                          self._formats[PROMPT])

    def append_event(self, event, scroll: bool = True) -> None:
        self.append_events([event], scroll)

    def append_events(self, events: list, scroll: bool = True) -> None:
        """Draw rounds at the end of the view in one edit block, so the document is laid out once per batch
        rather than once per token (the difference between a 50 ms and a 5 ms UI tick on long outputs)."""
        follow = scroll and self._at_bottom()
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.End)
        cursor.beginEditBlock()
        for event in events:
            if event.round > 0 and not self.clean:
                self._boundaries.append(self.document().characterCount() - 1)
            for info in round_tokens(event, self.clean):
                self._insert_token(info, cursor)
        cursor.endEditBlock()
        if follow:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def append_finish(self, reason: str) -> None:
        self._insert(f"  [{reason}]", self._formats[NOTICE])

    def _insert_token(self, info: TokenInfo, cursor: Optional[QTextCursor] = None) -> None:
        fmt = self._token_format(info.kind)
        fmt.setProperty(ROUND_PROP, info.round)
        fmt.setAnchor(True)
        fmt.setAnchorHref(f"t{len(self.tokens)}")
        self.tokens.append(info)
        self._token_ranges.append(self._insert(display_text(info, self.clean), fmt, cursor))

    def _insert(self, text: str, fmt: QTextCharFormat, cursor: Optional[QTextCursor] = None) -> tuple:
        """Insert at the end; returns the (start, end) document positions of the text."""
        if cursor is None:
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.End)
        start = cursor.position()
        cursor.insertText(text, fmt)
        return start, cursor.position()

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    # ---------------------------------------------------------------------------------------------- lookup
    def token_at(self, pos: QPoint) -> Optional[TokenInfo]:
        href = self.anchorAt(pos)
        if href.startswith("t") and href[1:].isdigit() and int(href[1:]) < len(self.tokens):
            return self.tokens[int(href[1:])]
        return None

    def rendered_spans(self) -> list:
        """[(kind, text, round)] read back from the document's character formats (rounds: -1 = none)."""
        spans: list = []
        block = self.document().begin()
        while block.isValid():
            last = None
            it = block.begin()
            while not it.atEnd():
                frag = it.fragment()
                last = frag.charFormat()
                _add_piece(spans, last, frag.text())
                it += 1
            if block.next().isValid():
                _add_piece(spans, last if last is not None else block.charFormat(), "\n")
            block = block.next()
        return [(kind, text, rnd) for kind, text, rnd, _ in spans]

    def generated_text(self) -> str:
        """The clean text of the whole generation shown (without the prompt)."""
        return clean_text(self.tokens)

    def selected_clean_text(self) -> str:
        """The selection as clean text: the prompt's and the emitted tokens' text, never rejected drafts,
        markers or ↵ glyphs. A partly selected token copies whole."""
        cursor = self.textCursor()
        start, end = cursor.selectionStart(), cursor.selectionEnd()
        pieces = []
        low, high = max(start, self._prompt_range[0]), min(end, self._prompt_range[1])
        if low < high:
            pieces.append(self._document_text(low, high).replace("↵", ""))
        for info, (first, last) in zip(self.tokens, self._token_ranges, strict=True):
            if info.kind in EMITTED_KINDS and first < end and last > start:
                pieces.append(info.text)
        return "".join(pieces)

    def _document_text(self, low: int, high: int) -> str:
        cursor = QTextCursor(self.document())
        cursor.setPosition(low)
        cursor.setPosition(high, QTextCursor.KeepAnchor)
        return cursor.selectedText().replace("\u2029", "\n")

    def createMimeDataFromSelection(self):
        from PySide6.QtCore import QMimeData

        data = QMimeData()
        data.setText(self.selected_clean_text())
        return data

    # ---------------------------------------------------------------------------------------------- events
    def viewportEvent(self, event) -> bool:
        if event.type() == QEvent.ToolTip:
            info = self.token_at(event.pos())
            if info is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), describe(info), self.viewport())
            return True
        return super().viewportEvent(event)

    def mousePressEvent(self, event) -> None:
        info = self.token_at(event.position().toPoint())
        if info is not None:
            self.tokenClicked.emit(info)
        super().mousePressEvent(event)

    def paintEvent(self, event) -> None:
        super().paintEvent(event)
        if not self._boundaries:
            return
        first = self.cursorForPosition(QPoint(0, 0)).position()
        last = self.cursorForPosition(QPoint(self.viewport().width(), self.viewport().height())).position()
        painter = QPainter(self.viewport())
        painter.setPen(QPen(QColor(self.colors.boundary), 1))
        visible = self._boundaries[bisect_left(self._boundaries, first):bisect_right(self._boundaries, last)]
        for pos in visible:
            cursor = QTextCursor(self.document())
            cursor.setPosition(pos)
            rect = self.cursorRect(cursor)
            painter.drawLine(rect.left(), rect.top() + 1, rect.left(), rect.bottom() - 1)
        painter.end()


def _property(fmt: QTextCharFormat, prop: int, default):
    """fmt.property(), asked only when present: PySide6 6.12 drops a reference to None for a missing one."""
    return fmt.property(prop) if fmt.hasProperty(prop) else default


def _add_piece(spans: list, fmt: QTextCharFormat, text: str) -> None:
    kind = _property(fmt, KIND_PROP, "")
    rnd = _property(fmt, ROUND_PROP, None)
    href = fmt.anchorHref() if fmt.isAnchor() else ""
    if spans and spans[-1][0] == kind and spans[-1][3] == href and (href or kind in (PROMPT, NOTICE)):
        k, t, r, h = spans[-1]
        spans[-1] = (k, t + text, r, h)
    else:
        spans.append((kind, text, -1 if rnd is None else int(rnd), href))
