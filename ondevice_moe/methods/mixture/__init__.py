"""A mixture of experts spelled out in the recipe: any kinds, any roles, any router."""
