// Fault injection (launch/fault.h): DTRAIN_FAULT's faults are read for one rank and one start
// of the job, bad specs are refused naming the part that cannot be read, and a fault fires only
// at its step and phase. The faults' effects on real runs (kill, stop, hang, exit, drop) are
// tested through the launcher in cli_test.cpp and hardening_test.cpp.
#include "dtrain/launch/fault.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/core/error.h"

namespace {

using dtrain::launch::Fault;
using dtrain::launch::FaultKind;
using dtrain::launch::FaultPhase;
using dtrain::launch::faults_from_env;
using dtrain::launch::inject_faults;
using dtrain::launch::parse_all_faults;
using dtrain::launch::parse_faults;

// The message of the dtrain::Error that parsing `spec` raises ("" when it does not).
std::string refusal(const std::string& spec) {
  try {
    parse_faults(spec, 0, 0);
  } catch (const dtrain::Error& e) {
    EXPECT_EQ(e.component(), "train");
    return e.message();
  }
  return {};
}

const std::string kSpec =
    "kill:rank=1:step=5,delay:rank=0:step=3:ms=20:phase=allreduce,stop:rank=1:step=7:attempt=any,"
    "exit:rank=1:step=9:attempt=2,drop:rank=2:step=4:phase=checkpoint,hang:phase=step:step=6:rank=2";

TEST(Fault, ReadsTheFaultsOfOneRankOnOneStart) {
  const std::vector<Fault> first = parse_faults(kSpec, 1, 0);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].kind, FaultKind::kill);
  EXPECT_EQ(first[0].step, 5);
  EXPECT_EQ(first[0].phase, FaultPhase::step);
  EXPECT_EQ(first[0].attempt, 0);
  EXPECT_EQ(first[1].kind, FaultKind::stop);
  EXPECT_EQ(first[1].attempt, -1);  // any
  // The third start: the fault of every start and the one of that start.
  const std::vector<Fault> third = parse_faults(kSpec, 1, 2);
  ASSERT_EQ(third.size(), 2u);
  EXPECT_EQ(third[0].kind, FaultKind::stop);
  EXPECT_EQ(third[1].kind, FaultKind::exit);
  EXPECT_EQ(third[1].step, 9);
  EXPECT_TRUE(parse_faults(kSpec, 1, 1).size() == 1 && parse_faults(kSpec, 1, 1)[0].kind == FaultKind::stop);

  const std::vector<Fault> rank0 = parse_faults(kSpec, 0, 0);
  ASSERT_EQ(rank0.size(), 1u);
  EXPECT_EQ(rank0[0].kind, FaultKind::delay);
  EXPECT_EQ(rank0[0].ms, 20);
  EXPECT_EQ(rank0[0].phase, FaultPhase::allreduce);
  // Parts in any order after the kind.
  const std::vector<Fault> rank2 = parse_faults(kSpec, 2, 0);
  ASSERT_EQ(rank2.size(), 2u);
  EXPECT_EQ(rank2[0].kind, FaultKind::drop);
  EXPECT_EQ(rank2[0].phase, FaultPhase::checkpoint);
  EXPECT_EQ(rank2[1].kind, FaultKind::hang);
  EXPECT_EQ(rank2[1].step, 6);
  EXPECT_EQ(rank2[1].rank, 2);

  EXPECT_TRUE(parse_faults(kSpec, 3, 0).empty());
  EXPECT_TRUE(parse_faults("", 0, 0).empty());
}

TEST(Fault, ReadsEveryFaultOfASpecWhateverRankAndStart) {
  const std::vector<Fault> all = parse_all_faults(kSpec);
  ASSERT_EQ(all.size(), 6u);
  const FaultKind kinds[] = {FaultKind::kill, FaultKind::delay, FaultKind::stop,
                             FaultKind::exit, FaultKind::drop,  FaultKind::hang};
  const int ranks[] = {1, 0, 1, 1, 2, 2};
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].kind, kinds[i]) << i;
    EXPECT_EQ(all[i].rank, ranks[i]) << i;
  }
  EXPECT_EQ(all[3].attempt, 2);
  EXPECT_TRUE(parse_all_faults("").empty());
  EXPECT_THROW(parse_all_faults("kill:rank=0:step=1,bogus:rank=1:step=2"), dtrain::Error);
}

TEST(Fault, RefusesASpecItCannotReadNamingThePart) {
  const std::string expected =
      "(expected kill|stop|delay|drop|hang|exit|skip|extra|mismatch|bitflip:rank=R:step=S[:phase=step|allreduce|"
      "checkpoint|optimizer]"
      "[:attempt=A|any][:ms=M])";
  EXPECT_EQ(refusal("bogus"), "DTRAIN_FAULT 'bogus': cannot read 'bogus' " + expected);
  EXPECT_EQ(refusal("kill:rank=x:step=1"), "DTRAIN_FAULT 'kill:rank=x:step=1': cannot read 'rank=x' " + expected);
  EXPECT_EQ(refusal("kill:rank=0:step=2:phase=later"),
            "DTRAIN_FAULT 'kill:rank=0:step=2:phase=later': cannot read 'phase=later' " + expected);
  // A second kind is not a kind but an unknown part.
  EXPECT_EQ(refusal("kill:stop:rank=0:step=1"),
            "DTRAIN_FAULT 'kill:stop:rank=0:step=1': cannot read 'stop' " + expected);
  // One bad fault in a list refuses the list, even when it is another rank's.
  EXPECT_EQ(refusal("kill:rank=3:step=1,kill:rank=3"),
            "DTRAIN_FAULT 'kill:rank=3:step=1,kill:rank=3': 'kill:rank=3' needs a kind (kill, stop, delay, drop, hang, "
            "exit, skip, extra, mismatch or bitflip) first, rank=R and step=S (S >= 1)");
  EXPECT_NE(refusal("rank=0:step=1").find("needs a kind"), std::string::npos);
  EXPECT_NE(refusal("kill:rank=0:step=0").find("needs a kind"), std::string::npos);
  EXPECT_EQ(refusal("delay:rank=0:step=1"),
            "DTRAIN_FAULT 'delay:rank=0:step=1': 'delay:rank=0:step=1': ms=M (M > 0) goes with delay, and only with "
            "delay");
  EXPECT_NE(refusal("kill:rank=0:step=1:ms=5").find("goes with delay, and only with delay"), std::string::npos);
  EXPECT_EQ(refusal("kill:rank=0:step=1"), "");
}

TEST(Fault, ReadsTheEnvironmentForTheStartDtrainRestartNames) {
  ::setenv("DTRAIN_FAULT", "kill:rank=0:step=2:attempt=1,stop:rank=0:step=3", 1);
  ::unsetenv("DTRAIN_RESTART");
  std::vector<Fault> f = faults_from_env(0);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].kind, FaultKind::stop);
  ::setenv("DTRAIN_RESTART", "1", 1);
  f = faults_from_env(0);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].kind, FaultKind::kill);
  ::setenv("DTRAIN_FAULT", "", 1);
  EXPECT_TRUE(faults_from_env(0).empty());
  ::unsetenv("DTRAIN_FAULT");
  ::unsetenv("DTRAIN_RESTART");
  EXPECT_TRUE(faults_from_env(0).empty());
}

TEST(Fault, FiresOnlyAtItsStepAndPhase) {
  using Clock = std::chrono::steady_clock;
  // A delay far longer than the test: had it fired at the wrong point, the test would take a minute.
  const std::vector<Fault> late = parse_faults("delay:rank=0:step=3:ms=60000:phase=allreduce", 0, 0);
  auto t0 = Clock::now();
  inject_faults(late, 2, FaultPhase::allreduce);
  inject_faults(late, 3, FaultPhase::step);
  inject_faults(late, 3, FaultPhase::checkpoint);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(30));
  const std::vector<Fault> brief = parse_faults("delay:rank=0:step=3:ms=60", 0, 0);
  t0 = Clock::now();
  inject_faults(brief, 3, FaultPhase::step);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(60));
}

// skip, extra and mismatch act once, on the first collective at or after their step.
TEST(Fault, OrderFaultsActOnceOnTheFirstCollectiveFromTheirStep) {
  auto calls = [](std::vector<Fault>& faults, int64_t step) {
    std::string out;
    collective_with_faults(
        faults, step, [&] { out += "c"; }, [&] { out += "o"; });
    return out;
  };
  std::vector<Fault> skip = parse_faults("skip:rank=1:step=3", 1, 0);
  EXPECT_EQ(calls(skip, 2), "c");
  EXPECT_EQ(calls(skip, 4), "");  // step 3 had no collective: the next one is skipped
  EXPECT_EQ(calls(skip, 5), "c");
  std::vector<Fault> extra = parse_faults("extra:rank=1:step=1", 1, 0);
  EXPECT_EQ(calls(extra, 1), "cc");
  EXPECT_EQ(calls(extra, 2), "c");
  std::vector<Fault> mismatch = parse_faults("mismatch:rank=1:step=2", 1, 0);
  EXPECT_EQ(calls(mismatch, 2), "o");
  EXPECT_EQ(calls(mismatch, 2), "c");
  // inject_faults leaves them alone.
  inject_faults(parse_faults("skip:rank=0:step=1,extra:rank=0:step=1,mismatch:rank=0:step=1", 0, 0), 1,
                FaultPhase::step);
}

}  // namespace
