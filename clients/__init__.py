"""Engine-side client library of kvrc: sessions, lookups, leases and the Mooncake data plane."""
