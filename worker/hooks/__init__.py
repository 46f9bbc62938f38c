"""The worker's uses of other libraries' private names, one module per library."""
