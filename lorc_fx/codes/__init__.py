"""What a cached value is stored as: integer group codes (``integer``, KIVI's layouts) and
product vector codes (``vector``). Pure tensor maths over codes and specs, no model: the plan
names a side's code, the cache stores it, the compiled attention reads it."""
