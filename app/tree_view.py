"""One round's draft drawn as a tree: the committed context at the root, every drafted token a box linked to
its parent, the accepted path ending in the target's correction or bonus token. Chains draw as a straight
line."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontDatabase, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QScrollArea, QToolTip, QVBoxLayout, QWidget

from app.round_view import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    REJECTED,
    TARGET,
    UNTESTED,
    TokenInfo,
    describe,
    drafted_info,
    is_greedy_test,
    next_info,
    token_chips,
    visible_whitespace,
)
from app.style import LIGHT, TokenColors

ROOT = "root"
BOX_CHARS = 12  # longer token texts are elided in the box (the tooltip shows them whole)
COLUMN_GAP, ROW_GAP, MARGIN = 28, 8, 10


@dataclass
class TreeNode:
    info: Optional[TokenInfo]  # None for the root (the committed context)
    column: int  # 0 for the root, depth + 1 for a drafted token
    row: int
    parent: Optional[int]  # index of the parent node; None for the root

    @property
    def kind(self) -> str:
        return self.info.kind if self.info is not None else ROOT


def tree_layout(event) -> list:
    """Nodes of one round: the root, the drafted tokens, then the next token hanging off the last accepted
    draft (or the root). Leaves take consecutive rows in depth-first order; a parent sits on its first child's
    row."""
    nodes = [TreeNode(None, 0, 0, None)]
    index_of = {}  # drafted index -> node index
    for i, d in enumerate(event.drafted):
        kind = ACCEPTED if d.accepted else (REJECTED if d.tested else UNTESTED)
        index_of[i] = len(nodes)
        nodes.append(TreeNode(drafted_info(event, d, kind, None), d.depth + 1, 0,
                              0 if d.parent < 0 else index_of[d.parent]))
    path = [i for i, d in enumerate(event.drafted) if d.accepted]
    anchor = index_of[max(path, key=lambda i: event.drafted[i].depth)] if path else 0
    nodes.append(TreeNode(next_info(event, event.position + len(path)), nodes[anchor].column + 1, 0, anchor))
    _assign_rows(nodes)
    return nodes


def _assign_rows(nodes: list) -> None:
    children: dict = {}
    for index, node in enumerate(nodes):
        if node.parent is not None:
            children.setdefault(node.parent, []).append(index)
    next_row = 0
    stack = [0]
    visited = []
    while stack:  # depth-first, children in draft order
        index = stack.pop()
        visited.append(index)
        stack.extend(reversed(children.get(index, [])))
    for index in visited:
        kids = children.get(index)
        if not kids:
            nodes[index].row = next_row
            next_row += 1
    for index in reversed(visited):  # a parent takes its first child's row (children are placed already)
        kids = children.get(index)
        if kids:
            nodes[index].row = nodes[kids[0]].row


class DraftTreeView(QWidget):
    """Paints `tree_layout(event)`; hover shows a token's details, a click emits tokenClicked(TokenInfo)."""

    tokenClicked = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.colors = LIGHT
        self.event = None
        self.nodes: list = []
        self._boxes: list = []  # QRectF per node

    def set_colors(self, colors: TokenColors) -> None:
        self.colors = colors
        self.update()

    def set_event(self, event) -> None:
        """Show this round's draft (None clears the view)."""
        self.event = event
        self.nodes = tree_layout(event) if event is not None else []
        self._boxes = self._place(self.nodes)
        right = max((box.right() for box in self._boxes), default=0.0)
        bottom = max((box.bottom() for box in self._boxes), default=0.0)
        size = QSize(int(right + MARGIN), int(bottom + MARGIN))
        if size != self.minimumSize():  # a resize only when the tree's extent changes
            self.setMinimumSize(size)
            self.resize(size)
        self.update()

    def _label(self, node: TreeNode) -> str:
        if node.info is None:
            return f"round {self.event.round + 1}" if self.event is not None else ""
        text = visible_whitespace(node.info.text)
        return text if len(text) <= BOX_CHARS else text[:BOX_CHARS - 1] + "…"

    def _numbers(self, node: TreeNode) -> str:
        """The second line of a box: p, q and u of a draft (greedy: p only); p of the next token."""
        info = node.info
        if info is None:
            return "context"
        if info.depth is None:
            return f"p {info.p:.2f}" if info.p is not None else ""
        if not info.tested:
            return "not tested"
        if info.p is None:  # a served round: the server does not give its drafts' probabilities
            return "p, q: not given"
        if is_greedy_test(info):
            return f"p {info.p:.2f} greedy"
        return f"p {info.p:.2f} q {info.q:.2f} u {info.u:.2f}" if info.u is not None else f"p {info.p:.2f}"

    def _place(self, nodes: list) -> list:
        """Box per node: each column as wide as its widest label, rows two lines high (token; numbers)."""
        metrics = QFontMetrics(self.font())
        height = 2 * metrics.height() + 8
        widths: dict = {}
        for node in nodes:
            label = max(metrics.horizontalAdvance(self._label(node)),
                        metrics.horizontalAdvance(self._numbers(node))) + 14
            widths[node.column] = max(widths.get(node.column, 0), label)
        lefts, x = {}, float(MARGIN)
        for column in sorted(widths):
            lefts[column] = x
            x += widths[column] + COLUMN_GAP
        return [QRectF(lefts[n.column], MARGIN + n.row * (height + ROW_GAP), widths[n.column], height)
                for n in nodes]

    def node_at(self, x: float, y: float) -> Optional[int]:
        for index, box in enumerate(self._boxes):
            if box.contains(x, y):
                return index
        return None

    # -------------------------------------------------------------------------------------------- painting
    def _fill(self, kind: str) -> Optional[QColor]:
        c = self.colors
        fills = {ACCEPTED: c.accepted_bg, CORRECTION: c.correction_bg, BONUS: c.bonus_bg}
        return QColor(fills[kind]) if kind in fills else None

    def _ink(self, kind: str) -> QColor:
        c = self.colors
        return QColor({REJECTED: c.rejected_fg, UNTESTED: c.untested_fg, ROOT: c.prompt}.get(kind, c.text))

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(self.colors.plot_bg))
        edge = QPen(QColor(self.colors.boundary), 1.5)
        for node, box in zip(self.nodes, self._boxes):
            if node.parent is not None:
                parent = self._boxes[node.parent]
                on_path = node.kind in (ACCEPTED, CORRECTION, BONUS, TARGET)
                painter.setPen(QPen(QColor(self.colors.running), 2.5) if on_path else edge)
                painter.drawLine(parent.right(), parent.center().y(), box.left(), box.center().y())
        for node, box in zip(self.nodes, self._boxes):
            self._paint_box(painter, node, box)
        painter.end()

    def _paint_box(self, painter: QPainter, node: TreeNode, box: QRectF) -> None:
        fill = self._fill(node.kind)
        ink = self._ink(node.kind)
        painter.setPen(QPen(ink if fill is None else QColor(self.colors.boundary), 1))
        painter.setBrush(fill if fill is not None else QColor(self.colors.plot_bg))
        painter.drawRoundedRect(box, 4, 4)
        font = QFont(self.font())
        font.setStrikeOut(node.kind in (REJECTED, UNTESTED))
        painter.setFont(font)
        painter.setPen(ink)
        top, bottom = QRectF(box), QRectF(box)
        top.setBottom(box.center().y())
        bottom.setTop(box.center().y())
        painter.drawText(top.adjusted(0, 3, 0, 0), Qt.AlignCenter, self._label(node))
        font.setStrikeOut(False)
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.85))
        painter.setFont(font)
        painter.drawText(bottom.adjusted(0, 0, 0, -3), Qt.AlignCenter, self._numbers(node))

    # ---------------------------------------------------------------------------------------------- mouse
    def mouseMoveEvent(self, event) -> None:
        index = self.node_at(event.position().x(), event.position().y())
        if index is None or self.nodes[index].info is None:
            QToolTip.hideText()
            return
        QToolTip.showText(event.globalPosition().toPoint(), describe(self.nodes[index].info), self)

    def mousePressEvent(self, event) -> None:
        index = self.node_at(event.position().x(), event.position().y())
        if index is not None and self.nodes[index].info is not None:
            self.tokenClicked.emit(self.nodes[index].info)


def tree_legend_html(colors: TokenColors) -> str:
    return " ".join(token_chips(colors) + [
        f"<span style='color:{colors.running}'>━</span> accepted path",
        "· p: target probability, q: drafter's, u: the uniform it was tested against",
    ])


class TreePanel(QWidget):
    """The Draft tree dock: a legend, the tree of one round (scrolls when large), and buttons to move
    between rounds. While `following`, it shows each new round as it arrives."""

    roundChanged = Signal(int)  # the 0-based round now shown

    def __init__(self, parent=None):
        super().__init__(parent)
        self.view = DraftTreeView()
        self.events: list = []
        self.index = -1
        self.following = True
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.position = QLabel("no round")
        self.buttons = {}
        row = QHBoxLayout()
        for key, text, tip in (("first", "|◀", "first round"), ("prev", "◀", "previous round"),
                               ("next", "▶", "next round"), ("last", "▶|", "latest round (follows the run)")):
            button = QPushButton(text)
            button.setToolTip(tip)
            button.setMaximumWidth(36)
            button.clicked.connect(lambda _=False, k=key: self.step(k))
            self.buttons[key] = button
            row.addWidget(button)
        row.addWidget(self.position, 1)
        scroll = QScrollArea()
        scroll.setWidget(self.view)
        scroll.setWidgetResizable(False)
        column = QVBoxLayout(self)
        column.setContentsMargins(2, 2, 2, 2)
        column.addLayout(row)
        column.addWidget(scroll, 1)
        column.addWidget(self.legend)
        self.set_colors(LIGHT)

    def set_colors(self, colors: TokenColors) -> None:
        self.view.set_colors(colors)
        self.legend.setText(tree_legend_html(colors))

    def set_events(self, events: list) -> None:
        """Another generation: show its latest round and follow it."""
        self.events = events
        self.following = True
        self.show_round(len(events) - 1, follow=True)

    def follow(self, events: list) -> None:
        """New rounds arrived: show the latest one unless the user moved to another round."""
        self.events = events
        if self.following:
            self.show_round(len(events) - 1, follow=True)
        else:
            self._label()

    def show_round(self, index: int, follow: bool = False) -> None:
        self.following = follow or index >= len(self.events) - 1
        self.index = index if 0 <= index < len(self.events) else -1
        event = self.events[self.index] if self.index >= 0 else None
        if self.view.event is not event:
            self.view.set_event(event)
        self._label()
        if self.index >= 0:
            self.roundChanged.emit(self.index)

    def step(self, key: str) -> None:
        last = len(self.events) - 1
        target = {"first": 0, "prev": self.index - 1, "next": self.index + 1, "last": last}[key]
        if self.events:
            self.show_round(min(max(target, 0), last), follow=key == "last")

    def _label(self) -> None:
        total = len(self.events)
        live = self.following and total and not getattr(self.events[-1], "finished", True)
        self.position.setText(f"round {self.index + 1} of {total}" + (" (live)" if live else "")
                              if self.index >= 0 else "no round")
