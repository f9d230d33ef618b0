"""The example's MCP server: unit conversion, two tools, no network. Written with the MCP Python SDK (``MCPServer``,
the SDK's FastMCP) and run over stdio by ``env: mcp`` inside trajlab's sandbox:

    /usr/bin/python3 examples/mcp_judge/server.py      (with the ``mcp`` package on PYTHONPATH)

Each task asks for one conversion, so its answer is a number the env and the judge can check. ``make_tasks.py``
imports ``UNITS`` and ``convert_value`` from here, so the tasks' answers are what the tool returns.
"""

from __future__ import annotations

UNITS: dict[str, tuple[str, float]] = {
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "yd": ("length", 0.9144), "mi": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "oz": ("mass", 0.028349523125), "lb": ("mass", 0.45359237),
    "ml": ("volume", 0.001), "l": ("volume", 1.0), "cup": ("volume", 0.2365882365), "gal": ("volume", 3.785411784),
}
"""Each unit's quantity and its size in the quantity's base unit (metre, kilogram, litre)."""


def convert_value(value: float, from_unit: str, to_unit: str) -> str:
    """``value`` in ``from_unit`` as ``to_unit``, rounded to 2 decimals and written without trailing zeros.

    Raises:
        ValueError: an unknown unit, or units of different quantities.
    """
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; call list_units for the known ones")
    (quantity, size), (other, target) = UNITS[from_unit], UNITS[to_unit]
    if quantity != other:
        raise ValueError(f"cannot convert {quantity} ({from_unit}) to {other} ({to_unit})")
    return f"{value * size / target:.2f}".rstrip("0").rstrip(".")


def build_server():  # noqa: ANN201 (the SDK's type; mcp is imported here, so make_tasks.py needs no mcp)
    """The MCP server and its tools."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("unit-converter")

    @server.tool()
    def convert(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a value from one unit to another of the same quantity (length, mass or volume); the result is
        rounded to 2 decimals."""
        return convert_value(value, from_unit, to_unit)

    @server.tool()
    def list_units() -> str:
        """The units convert knows, by quantity."""
        by_quantity: dict[str, list[str]] = {}
        for unit, (quantity, _) in UNITS.items():
            by_quantity.setdefault(quantity, []).append(unit)
        return "; ".join(f"{quantity}: {', '.join(units)}" for quantity, units in by_quantity.items())

    return server


if __name__ == "__main__":
    build_server().run("stdio")
