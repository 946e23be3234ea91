"""What a cached value is stored as: integer group codes (``integer``, KIVI's layouts),
product vector codes (``vector``) and row codes under power-of-two scales (``rows``: what a
cache layer that rewrites what it read keeps). Pure tensor maths over codes and specs, no
model: the plan names a side's code, the cache stores it, the compiled attention reads it."""
