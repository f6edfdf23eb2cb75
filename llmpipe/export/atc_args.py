"""ATC's argument rules that a config can be checked against without ATC: the SoC names it knows and
the --dynamic_dims gears an --input_shape needs. A leaf (no llmpipe import but errors): the config
checks read it when a config loads; llmpipe.export.atc builds the command line with it."""

from __future__ import annotations

from llmpipe.errors import UserError


class AtcArgsError(UserError, ValueError):
    """convert_om's ATC arguments do not fit together; the message names the field."""


MIN_GEARS, MAX_GEARS = 2, 100  # ATC's bounds on the number of --dynamic_dims gears


# The --soc_version names ATC accepts: its documentation gives them as "Ascend" + the chip name npu-smi
# (or ascend-dmi) reports (Ascend310, Ascend310P*, Ascend310B*, Ascend910*; the Atlas A3 parts as
# Ascend910_<NPU name>), and these are the parts CANN ships a platform_config/<name>.ini for. A name
# outside the list is refused when the config loads (llmpipe.config_checks) instead of by ATC after
# training; add a new chip here.
SOC_VERSIONS = (
    "Ascend310",
    "Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4",
    "Ascend310P1", "Ascend310P3", "Ascend310P5", "Ascend310P7",
    "Ascend910", "Ascend910A", "Ascend910B", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA",
    "Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1",
    "Ascend910_9362", "Ascend910_9372", "Ascend910_9381", "Ascend910_9382", "Ascend910_9391", "Ascend910_9392",
)


def _dynamic_dim_count(input_shape: str) -> int:
    """Number of -1 dims over all inputs of an ATC --input_shape ("name:1,-1;name2:1,-1")."""
    count = 0
    for spec in filter(None, (s.strip() for s in input_shape.split(";"))):
        _, _, dims = spec.rpartition(":")  # input names may themselves contain ':'
        count += sum(d.strip() == "-1" for d in dims.split(","))
    return count


def check_dynamic_dims(input_shape: str | None, dynamic_dims: str | None) -> None:
    """ATC's rule: -1 dims need gears, and every gear gives one value per -1 dim; 2 to 100 gears."""
    if not dynamic_dims:
        if input_shape and _dynamic_dim_count(input_shape):
            raise AtcArgsError(f"convert_om.input_shape {input_shape!r} has -1 dims but convert_om.dynamic_dims "
                               "is null: ATC needs gears (e.g. dynamic_dims '16;32;64') or fixed dims")
        return
    if not input_shape:
        raise AtcArgsError(f"convert_om.dynamic_dims ({dynamic_dims!r}) needs convert_om.input_shape "
                           "with -1 dims")
    n_dynamic = _dynamic_dim_count(input_shape)
    if n_dynamic == 0:
        raise AtcArgsError(f"convert_om.dynamic_dims ({dynamic_dims!r}) needs -1 dims in "
                           f"convert_om.input_shape, but {input_shape!r} has none")
    gears = [g.strip() for g in dynamic_dims.strip().strip(";").split(";")]
    if not MIN_GEARS <= len(gears) <= MAX_GEARS:
        raise AtcArgsError(f"convert_om.dynamic_dims: ATC takes {MIN_GEARS} to {MAX_GEARS} gears, "
                           f"got {len(gears)} in {dynamic_dims!r}")
    for i, gear in enumerate(gears, 1):
        values = [v.strip() for v in gear.split(",")]
        if len(values) != n_dynamic:
            raise AtcArgsError(f"convert_om.dynamic_dims: gear {i} ({gear!r}) has {len(values)} values, but "
                               f"convert_om.input_shape {input_shape!r} has {n_dynamic} -1 dims "
                               "(one value each)")
        if not all(v.isdigit() and int(v) > 0 for v in values):
            raise AtcArgsError(f"convert_om.dynamic_dims: gear {i} ({gear!r}) must be positive integers")


def check_soc_version(name: str) -> None:
    """AtcArgsError naming convert_om.soc_version, the value and the closest known names unless ATC
    knows `name` (SOC_VERSIONS; the names are case-sensitive)."""
    if name in SOC_VERSIONS:
        return
    import difflib

    by_lower = {s.lower(): s for s in SOC_VERSIONS}
    close = [by_lower[m] for m in difflib.get_close_matches(name.lower(), by_lower, n=4, cutoff=0.6)]
    hint = f"closest: {', '.join(close)}" if close else "e.g. Ascend910B2, Ascend310P3"
    raise AtcArgsError(f"convert_om.soc_version: {name!r} is not an Ascend SoC that ATC knows ({hint})")
