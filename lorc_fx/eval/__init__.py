"""Applications of the compiler: quality evaluation on real text (``evaluate``), sweeps over
fractions and options (``sweep``), and the main job (``demo``)."""
