"""3D-parallel planning, split by concern; the public face is :mod:`tokenloom.plan`.

specs (inputs) -> formulas (published equations) -> layout (one candidate's cost)
-> search (enumerate and rank) -> geometry (the file build and serve read) -> report (table).
"""
