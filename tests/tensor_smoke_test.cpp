#include <gtest/gtest.h>

#include "dtrain/tensor/ops.h"

using namespace dtrain;

TEST(TensorSmoke, AddBackward) {
  Tensor a = Tensor::from_vector({2, 2}, {1, 2, 3, 4}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({2}, {10, 20}).set_requires_grad(true);
  Tensor loss = ops::sum(ops::mul(a + b, a));
  loss.backward();
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{12, 24, 16, 28}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<float>{4, 6}));
}
