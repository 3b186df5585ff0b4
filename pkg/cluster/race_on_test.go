//go:build race

package cluster

// raceDetector is true in a -race build (see TestLeaderSlowsDownForAFollowersClients).
const raceDetector = true
